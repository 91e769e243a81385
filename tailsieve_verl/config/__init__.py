"""Hydra configs shipped with tailsieve-verl (``pkg://tailsieve_verl.config``)."""
