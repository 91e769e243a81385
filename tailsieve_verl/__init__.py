"""TailSieve for verl: partial-rollout-guided tail routing.

`tailsieve_verl.core` is framework-free (numpy/scipy only); `tailsieve_verl.integration` is the
thin verl 0.9.1 layer.
"""

__version__ = "0.1.0"
