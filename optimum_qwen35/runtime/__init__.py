"""Running a model's static-shape graphs: the host loop (`Qwen35Runtime`, host_loop.py) over a graph runner (the
decoder's modules in this process, eager.py; a cpu export's programs, exported.py, in worker processes per rank,
worker_pool.py; a Neuron export's traced model, backends/nxd/runner.py)."""

from optimum_qwen35.runtime.host_loop import Qwen35Runtime

__all__ = ["Qwen35Runtime"]
