"""Roles: the learner and the searcher (built from the config by hpc_tba.assembly.build)."""
