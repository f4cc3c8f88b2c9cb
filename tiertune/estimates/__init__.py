"""Will a recipe fit, and how fast will it run, before anything is loaded: ``report`` (the run's layout
planned and a step replayed on a ledger store), ``speed`` (a step's FLOPs, GPUs, measured rates) and
``longest`` (the longest sequence within the budgets)."""
