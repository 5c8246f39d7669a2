"""The lab: `python -m lattice_mlx.bench` (run.py), its statistics and reports, random checkpoints and models of
the family's shapes (synthetic.py) and the oracle drafters that set a benchmark's acceptance (oracles.py). Nothing in
the runtime imports it."""
