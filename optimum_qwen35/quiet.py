"""Quiet by default: what third-party libraries print that says nothing to this package's users.

- Importing optimum-neuron on a machine without a Neuron device logs "No major for neuron device could be found in
  /proc/devices!" and warns that the compilation target is overridden to trn1 (optimum/neuron/__init__.py): true of
  the machine, noise for the cpu target, printed by every command. `optimum_neuron_import()` hides both while this
  package imports optimum-neuron, and the start-up hook (`_startup.py`) while any program does (the override itself
  still happens; a program that imports optimum-neuron before `optimum_qwen35`, without the start-up file of a
  regular install, sees them as before).
- transformers' `pipeline("image-text-to-text")` checks the model's class name against a fixed list of its own
  classes and logs an error for any other, then runs it. `image_text_to_text_pipeline()` drops that record for this
  package's model classes only.
- huggingface_hub logs two warnings per retry of a failed request (five retries: a push whose connection drops prints
  a screen of them before this package's one-line error). `hub_retries()` hides those while a Hub call runs, bounds
  the retries (3, waiting 1 + 2 + 2 s instead of 1 + 2 + 4 + 8 + 8 s: a `cache lookup` against an unreachable Hub
  took 31 s) and says once that it is retrying.

- transformers 4.57's `Pipeline.__init__` logs "Device set to use cpu" as a warning for every pipeline (5.x logs it at
  debug level). `pipeline_device_line()` drops that record when the pipeline's model is one of this package's classes;
  transformers' logging is otherwise untouched (other models' pipelines still log it).

`OPTIMUM_QWEN35_VERBOSE=1` (what the command line's `--verbose` sets) shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager

VERBOSE_ENV = "OPTIMUM_QWEN35_VERBOSE"
NEURON_PROBE_LOGGER = "optimum.neuron.utils.system"
TARGET_OVERRIDE_WARNING = "It seems this is running on a CPU-only machine"
HUB_HTTP_LOGGER = "huggingface_hub.utils._http"
PIPELINE_LOGGER = "transformers.pipelines.base"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes", "on")


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


@contextmanager
def _filtered(logger_name: str, *fragments: str):
    if verbose():
        yield
        return
    logger, drop = logging.getLogger(logger_name), _DropMessages(*fragments)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextmanager
def optimum_neuron_import():
    """Around this package's `import optimum.neuron...`: no device-probe error, no target-override warning."""
    with _filtered(NEURON_PROBE_LOGGER, "No major for neuron device"), warnings.catch_warnings():
        if not verbose():
            warnings.filterwarnings("ignore", message=TARGET_OVERRIDE_WARNING, category=UserWarning)
        yield


# huggingface_hub's `http_backoff` (0.x and 2.x) retries 5 times, waiting 1, 2, 4, 8, 8 s; within a Hub call of this
# package, 3 times, waiting 1, 2, 2 s: HUB_RETRY_SECONDS in all.
HUB_RETRY_LIMITS = {"max_retries": 3, "base_wait_time": 1, "max_wait_time": 2}
HUB_RETRY_SECONDS = 5
HUB_RETRY_NOTICE = f"optimum-qwen35: the Hub did not answer; retrying each request for up to {HUB_RETRY_SECONDS} s"
NOTICE_LOGGER = "optimum_qwen35.hub"


@contextmanager
def _bounded_backoff():
    """Lower the keyword defaults of huggingface_hub's backoff helpers for the duration (callers that pass their own
    limits keep them). huggingface_hub has no setting for this; restored on exit."""
    try:
        from huggingface_hub.utils import _http
    except ImportError:
        yield
        return
    saved = []
    for name in ("http_backoff", "http_stream_backoff", "_http_backoff_base"):
        function = getattr(_http, name, None)
        defaults = getattr(function, "__kwdefaults__", None)
        if defaults and HUB_RETRY_LIMITS.keys() <= defaults.keys():
            saved.append((function, dict(defaults)))
            function.__kwdefaults__ = {**defaults, **HUB_RETRY_LIMITS}
    try:
        yield
    finally:
        for function, defaults in reversed(saved):
            function.__kwdefaults__ = defaults


class _AnnounceRetry(logging.Filter):
    """On huggingface_hub's first "Retrying in" record: one line of this package's own (passes every record)."""

    def __init__(self):
        super().__init__()
        self.done = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.done and "Retrying in" in record.getMessage():
            self.done = True
            logging.getLogger(NOTICE_LOGGER).warning(HUB_RETRY_NOTICE)
        return True


@contextmanager
def hub_retries():
    """Around a Hub call: at most HUB_RETRY_SECONDS of retry waits per request, announced once; huggingface_hub's
    per-retry warnings are not shown (the outcome is, once)."""
    logger, announce = logging.getLogger(HUB_HTTP_LOGGER), _AnnounceRetry()
    logger.filters.insert(0, announce)  # before the filter that drops the record
    try:
        with _bounded_backoff(), _filtered(HUB_HTTP_LOGGER, "thrown while requesting", "Retrying in"):
            yield
    finally:
        logger.removeFilter(announce)


def image_text_to_text_pipeline(class_names: list[str]) -> None:
    """For the life of the process (the user builds the pipeline, not this package): no "The model '...' is not
    supported for image-text-to-text" error for the named classes. Idempotent; `--verbose` keeps it."""
    if verbose():
        return
    logger = logging.getLogger(PIPELINE_LOGGER)
    fragments = tuple(f"The model '{name}' is not supported for image-text-to-text" for name in class_names)
    if not any(isinstance(f, _DropMessages) and f.fragments == fragments for f in logger.filters):
        logger.addFilter(_DropMessages(*fragments))


class _DropDeviceLine(logging.Filter):
    """Drops "Device set to use ..." when the `Pipeline.__init__` logging it holds a model of the named classes."""

    def __init__(self, class_names: tuple[str, ...]):
        super().__init__()
        self.class_names = class_names

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Device set to use") or record.funcName != "__init__":
            return True
        frame = sys._getframe(1)
        for _ in range(16):  # from here up to the logging call in Pipeline.__init__
            if frame is None:
                break
            if frame.f_code.co_name == "__init__" and frame.f_code.co_filename == record.pathname:
                model = getattr(frame.f_locals.get("self"), "model", None)
                return not any(c.__name__ in self.class_names for c in type(model).__mro__)
            frame = frame.f_back
        return True


def pipeline_device_line(class_names: list[str]) -> None:
    """For the life of the process: no "Device set to use cpu" for pipelines of the named model classes (the only
    device they run on, said by every pipeline). Idempotent; `--verbose` keeps it."""
    if verbose():
        return
    logger = logging.getLogger(PIPELINE_LOGGER)
    names = tuple(class_names)
    if not any(isinstance(f, _DropDeviceLine) and f.class_names == names for f in logger.filters):
        logger.addFilter(_DropDeviceLine(names))
