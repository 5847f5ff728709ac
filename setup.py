"""Packaging: hooks/ and megatron_patches/ install as commsched.hooks and
commsched.megatron_patches; no top-level "hooks" package lands in site-packages."""

from setuptools import setup

setup(
    name="commsched",
    version="0.1.0",
    description="Priority/credit communication scheduler for PyTorch DDP and Megatron-core",
    python_requires=">=3.10",
    packages=["commsched", "commsched.telemetry", "commsched.sim", "commsched.data_parallel",
              "commsched.hooks", "commsched.megatron_patches"],
    package_dir={
        "commsched": "commsched",
        "commsched.hooks": "hooks",
        "commsched.megatron_patches": "megatron_patches",
    },
    # The launcher's start-up hook for the processes a script starts (commsched/run.py):
    # a directory put on PYTHONPATH, not a package.
    package_data={"commsched": ["startup/sitecustomize.py"]},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "gpu": ["nvidia-ml-py", "nvtx"],
        "plots": ["matplotlib"],
        "megatron": ["megatron-core>=0.16"],
    },
    entry_points={"console_scripts": ["commsched = commsched.cli:main"]},
)
