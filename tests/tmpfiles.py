"""Files the tests write into their tmp_path (test_custom_reward.py, test_launch.py): a text file
(a --reward-fn module), and plain {"prompt", "answer"} rows as JSONL."""
import json


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def plain_jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))
