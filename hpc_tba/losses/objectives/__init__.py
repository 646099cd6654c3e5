"""The built-in objectives, one module each: its config (an AlgoConfig subclass), what it needs
and how it computes, registered in hpc_tba.losses.registry. The tensor math they call lives in
hpc_tba/losses/ (tb.py, topr_loss.py, alol_loss.py, baselines.py) and is imported when a loss is
computed, so composing a config imports no torch."""
