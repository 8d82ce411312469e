"""A tensor-parallel worker process (started by runtime/worker_pool.py's `WorkerPool`).

    python -m optimum_qwen35.runtime.tp_worker FOLDER RANK TP_DEGREE STORE_FILE FD THREADS RUNNER DIST_BACKEND OPTIONS

FD is this process's end of a socket pair with the parent, which sends graph calls over it; RUNNER the rank's runner
class ("module:Class"), DIST_BACKEND the process-group backend, OPTIONS the runner's keywords as JSON.
"""

import json
import sys
from multiprocessing.connection import Connection

import torch

from optimum_qwen35.runtime.worker_pool import serve_rank


def main(argv: list[str]) -> None:
    folder, rank, tp_degree, store, fd, threads, runner, dist_backend, options = argv
    torch.set_num_threads(int(threads))
    serve_rank(int(rank), int(tp_degree), store, folder, Connection(int(fd)), runner, dist_backend, json.loads(options))


if __name__ == "__main__":
    main(sys.argv[1:])
