"""Helper for test_checkpoint_crash.py: imports flatopt once, then on command forks a child
that saves checkpoints in a loop, so that the test can SIGKILL it at random moments.

Commands on stdin, one per line: ``save I`` (save once, here), ``fork I`` (a child saving
I, I+1, ... until killed; prints its pid), ``forkbg I`` (the same with background saves, each
next one filled while the previous one writes), ``reap PID`` (wait for it), ``quit``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import flatopt


def build() -> flatopt.Adam:
    return flatopt.Adam({"big": np.zeros(1 << 20, np.float32),
                         "table": np.zeros((128, 64), np.float64),
                         "bias": np.zeros(3, np.float32)})


def fill(opt: flatopt.Adam, i: int) -> None:
    """Every value of checkpoint number i is i, so a mixed or partial file would show."""
    for buf in opt.buffers:
        buf.params[...] = i
        for name in ("exp_avg", "exp_avg_sq"):
            buf.state_buffer(name)[...] = i
        buf.columns["step"][...] = i


def main(path: str) -> int:
    opt = build()
    print("ready", flush=True)
    for line in sys.stdin:
        command, argument = line.split()
        if command == "save":
            fill(opt, int(argument))
            flatopt.save(path, opt, metadata={"i": int(argument)})
            print("saved", flush=True)
        elif command in ("fork", "forkbg"):
            pid = os.fork()
            if pid == 0:  # the saver: runs until killed
                try:
                    i = int(argument)
                    while True:
                        fill(opt, i)  # forkbg: while the previous background save writes
                        flatopt.save(path, opt, metadata={"i": i},
                                     background=command == "forkbg")
                        i += 1
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(argument), 0)
            print(status, flush=True)
        elif command == "quit":
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
