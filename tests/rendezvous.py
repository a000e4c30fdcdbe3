"""Rendezvous for the tests' multi-process runs without a port race.

Binding port 0, closing the socket and handing its number to the workers leaves a window in which
another suite on the same machine (or any process) can take the port; under load two suites
then meet in one process group. Instead:
- mp.spawn workers rendezvous through a file in the test's temporary directory (file_init);
- plain processes that call distributed.init() (env://) meet on a TCPStore that the test process
  holds open on a port the OS picked, for as long as they run (held_store_env). torchrun does the
  same for its workers (--standalone: the agent's store on port 0, TORCHELASTIC_USE_AGENT_STORE).
"""
import contextlib

import torch.distributed as dist


def file_init(directory) -> str:
    """An init_method for dist.init_process_group: a file, not a port."""
    return f"file://{directory}/rendezvous"


@contextlib.contextmanager
def held_store_env():
    """-> the environment for env:// workers to join a store this process holds until the block
    ends (every rank connects as a client, as torchrun's workers do to the agent's store)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    finally:
        del store
