"""Package metadata for ftmaster.

The source folders follow the project's design card (``tools/ftmaster``, ``monitor``,
``recovery``, ``megatron/training``) while the import names stay namespaced:
``ftmaster``, ``ftmaster.monitor``, ``ftmaster.recovery`` and ``megatron.training`` (a portion
of the ``megatron`` namespace package that megatron-core also contributes to).
"""

from setuptools import Extension, setup

PACKAGE_DIRS = {
    "ftmaster": "tools/ftmaster",
    "ftmaster.monitor": "monitor",
    "ftmaster.recovery": "recovery",
    "megatron.training": "megatron/training",
}

setup(
    name="ftmaster",
    version="0.1.0",
    description="Proactive fault tolerance for Megatron training: GPU risk monitor, "
    "gap-filtered emergency checkpoints and automatic re-planned relaunch.",
    python_requires=">=3.10",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    # The memory tier's copy with streaming stores, loaded with ctypes: a machine without a C
    # compiler skips it, and the refill copies with memmove.
    ext_modules=[Extension("megatron.training._stream_copy", ["megatron/training/stream_copy.c"],
                           extra_compile_args=["-O2"], optional=True)],
    install_requires=[
        "torch",
        "megatron-core==0.16.1",
        "numpy",
        "psutil",
        "click",
        "pandas",
        "matplotlib",
        "nvidia-ml-py",
        "regex",
        "xxhash",
        "setproctitle",  # a warm worker shows its rank's command in ps
        "einops",  # megatron-core's parallel_state, for --num-distributed-optimizer-instances
        "prometheus_client",  # --metrics-port
    ],
    extras_require={
        # torch elastic's etcd-v2 rendezvous backend imports python-etcd
        "etcd": ["python-etcd"],
        # the trainer's --tensorboard-dir writes through torch.utils.tensorboard
        "tensorboard": ["tensorboard"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "python-etcd", "tensorboard"],
    },
    entry_points={"console_scripts": ["ftmaster=ftmaster.cli:main"]},
)
