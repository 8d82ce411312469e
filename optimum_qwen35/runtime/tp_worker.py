"""A tensor-parallel worker process of the cpu target (started by `compiled.TensorParallelGraphs`).

    python -m optimum_qwen35.runtime.tp_worker FOLDER RANK TP_DEGREE STORE_FILE FD THREADS

FD is this process's end of a socket pair with the parent, which sends graph calls over it.
"""

import sys
from multiprocessing.connection import Connection

import torch

from optimum_qwen35.runtime.worker_pool import serve_rank


def main(argv: list[str]) -> None:
    folder, rank, tp_degree, store, fd, threads = argv
    torch.set_num_threads(int(threads))
    serve_rank(int(rank), int(tp_degree), store, folder, Connection(int(fd)))


if __name__ == "__main__":
    main(sys.argv[1:])
