"""
Turn a run's metrics.jsonl into one PNG of the curves a person watches during DAPO training.

    python -m experiments.plot runs/demo/metrics.jsonl   # writes runs/demo/metrics.png
    python -m experiments.plot a/metrics.jsonl b/metrics.jsonl -o compare.png --labels naive dapo

`make run` ends with the first, into runs/demo/curves.png. Needs matplotlib (requirements.txt).
"""
import argparse
import json
import os

PANELS = [  # (title, [(metric, line style[, "right": on a second y axis])])
    ("reward", [("critic/score/mean", "-"), ("rollout/reward/mean", ":")]),
    ("accuracy", [("val/acc", "-o"), ("rollout/acc", ":")]),
    ("entropy (nats/token)", [("actor/entropy", "-")]),
    ("response length (tokens)", [("rollout/response_length/mean", "-"),
                                  ("rollout/response_length/max", ":")]),
    ("clip fraction", [("dapo/clipfrac_high", "-"), ("dapo/clipfrac_low", ":")]),
    ("dynamic sampling", [("train/groups_kept", "-"), ("train/groups_filtered", ":")]),
    # what the filter costs: the share of generated tokens not trained on (left), and the
    # response tokens generated per group trained on (right)
    ("cost of dynamic sampling", [("train/gen_tokens_discarded", "-"),
                                  ("train/gen_tokens_per_group", ":", "right")]),
]


def read_metrics(path):
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {number} is not JSON ({e.msg})") from None
    return rows


def series(rows, key):
    points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(paths, out, labels=None, panels=PANELS):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install -r requirements.txt") from None
    runs = [read_metrics(p) for p in paths]
    labels = labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    cols = 3
    n_rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 3.4 * ((len(panels) + 2) // 3)))
    for ax, (title, keys) in zip(axes.flat, panels):
        right = ax.twinx() if any(len(k) == 3 for k in keys) else None
        for i, (rows, label) in enumerate(zip(runs, labels)):
            for key, style, *side in keys:
                x, y = series(rows, key)
                if x:
                    (right if side else ax).plot(
                        x, y, style, color=f"C{i}", markersize=3,
                        label=f"{label} {key}" if len(runs) > 1 else key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        lines = ax.lines + (right.lines if right else [])
        if lines:
            ax.legend(lines, [line.get_label() for line in lines], fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files (one per run)")
    p.add_argument("-o", "--out", help="PNG to write (default: metrics.png beside the first file)")
    p.add_argument("--labels", nargs="*",
                   help="one label per run (default: the run directory's name)")
    args = p.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "metrics.png")
    print(f"curves: {plot(args.metrics, out, args.labels)}")


if __name__ == "__main__":
    main()
