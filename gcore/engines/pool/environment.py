"""What an engine worker process inherits from the controller: a clean environment, and how its end is told.

A worker runs the configured engines and rewards, so it gets what those need and nothing the trainer holds for
itself (tokens, keys, passwords of the trainer's environment). The rule (``worker_environment``):

- passed: the names in ``NAMES`` (the executable search path, the home folder, the locale, temporary folders,
  Python's own settings, the virtual environment, the library path, the compiler, the proxy and certificate
  settings a download needs) and every name that starts with one of
  ``PREFIXES`` (thread settings: ``OMP_``, ``MKL_`` ...; devices: ``CUDA_``, ``NVIDIA_``, ``HIP_`` ...;
  the libraries the engines run on: ``TORCH``, ``HF_``, ``TRANSFORMERS_``, ``VLLM_``, ``SGLANG_``, ``TRITON_``,
  ``NCCL_`` ...; and ``GCORE_``);
- withheld even then: a name with a part (split at ``_``) that marks a secret (``SECRET_PARTS``: ``TOKEN``,
  ``KEY``, ``SECRET``, ``PASSWORD`` ...), e.g. ``HF_TOKEN`` or ``VLLM_API_KEY``;
- added by the user: ``GCORE_WORKER_ENV=NAME,NAME`` passes those names as they are, a secret too (a worker that
  must download a gated model needs ``HF_TOKEN``; a login saved in the home folder works without it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Mapping

NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "PYTHONWARNINGS", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX", "PYTHONFAULTHANDLER", "VIRTUAL_ENV", "CONDA_PREFIX",
    "LD_LIBRARY_PATH", "CC", "CXX",  # the compiler Triton builds kernels with
    # reaching the model hub, where a worker downloads its model
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
})
PREFIXES = (
    "LC_", "XDG_",  # locale, cache folders
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",  # threads
    "CUDA_", "NVIDIA_", "CUBLAS_", "CUDNN_", "NCCL_", "HIP_", "ROCR_", "ROCM_",  # devices
    "TORCH", "PYTORCH_", "TRITON_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_",
    "VLLM_", "SGLANG_", "FLASHINFER_",  # the libraries engines run on
    "GCORE_", "COV_CORE_", "COVERAGE_",  # gcore's own; coverage of the worker processes in tests
)
#: a part of a name (split at ``_``) that marks it as a secret: withheld unless named in ``GCORE_WORKER_ENV``
SECRET_PARTS = frozenset({"TOKEN", "TOKENS", "KEY", "KEYS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS",
                          "CREDENTIAL", "CREDENTIALS", "AUTH", "COOKIE", "PRIVATE"})
#: the user's list of further names to pass (comma-separated)
EXTRA = "GCORE_WORKER_ENV"

_lock = threading.Lock()


def secret(name: str) -> bool:
    return any(part in SECRET_PARTS for part in name.upper().split("_"))


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a worker process gets (the rule is in this module's docstring)."""
    extra = {name.strip() for name in environ.get(EXTRA, "").split(",") if name.strip()}
    return {name: value for name, value in environ.items()
            if name in extra or ((name in NAMES or name.startswith(PREFIXES)) and not secret(name))}


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """Inside the block ``os.environ`` holds only ``worker_environment``'s variables (a process spawned there gets
    them); the whole environment is back afterwards, also when the block raises."""
    with _lock:
        saved = dict(os.environ)
        kept = worker_environment(saved)
        for name in [name for name in saved if name not in kept]:
            del os.environ[name]
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


def describe_exit(code: int | None) -> str:
    """``-9`` -> ``was killed by SIGKILL``; ``2`` -> ``exited with status 2``; ``None`` -> ``is gone``."""
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
