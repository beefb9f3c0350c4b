"""Which packages the wheel holds (everything else is in pyproject.toml).

The sbatch templates stay in the top-level `slurm/` folder, where site admins look for them,
and ship as the package `rft_hpc.slurm`: pyproject.toml's `packages.find` cannot add a
package mapped from outside `rft_hpc/`, so the packages are listed here.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["rft_hpc*"]), "rft_hpc.slurm"],
    package_dir={"rft_hpc.slurm": "slurm"},
    package_data={"rft_hpc.slurm": ["*.sbatch", "*.sh"]},
)
