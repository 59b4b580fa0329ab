"""Helpers of the crash-safe resume tests (test_resume, test_peft); the `one_thread` fixture is in conftest.py."""

import os


def truncate(path, keep=0.5):
    """Cut a file to ``keep`` of its length, as a crash in the middle of writing it leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def killed_in_child(fn) -> int:
    """Run ``fn`` in a forked child process (it has everything imported already) and return its wait status."""
    pid = os.fork()
    if pid == 0:  # the child: fn is expected to SIGKILL it; anything else is a failure
        try:
            fn()
        finally:
            os._exit(3)
    return os.waitpid(pid, 0)[1]
