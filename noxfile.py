"""Test environments.

Reference parity needs transformers >= 5 (it has `qwen3_5`), while optimum-neuron 0.4.x pins
transformers ~= 4.57: the two cannot share one environment, so each gets its own session.
`torch==2.13.0` is named explicitly: it is the local CPU build, a looser pin may pull a CUDA build.
"""

import nox

nox.options.sessions = ["reference", "optimum"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"


def _pytest(session, *marks):
    # Exit code 5 means "no test collected": always an error here, since every session selects tests.
    session.run("pytest", "-q", "-rs", *marks, *session.posargs)


@nox.session
def reference(session):
    """Everything, with transformers >= 5: parity against the reference and the fixture check."""
    session.install(TORCH, "-e", ".[tests,reference]")
    _pytest(session)


@nox.session
def optimum(session):
    """The optimum-neuron 0.4.5 entry points and transformers 4.57 support (no Neuron SDK)."""
    session.install(TORCH, "-e", ".[tests,optimum]")
    _pytest(session, "-m", "not reference")
