"""Roles: learner, searcher, and how to build the one a rank plays."""
