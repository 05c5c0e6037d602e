"""Tools that are not roles: ``zclaw status``, ``plot``, ``eval``, ``export``.

They talk to the roles only through their public surfaces (``status`` requests, checkpoints, the run
directory's records), never by importing a role's internals, and keep heavy imports (matplotlib,
imageio, MuJoCo rendering) inside the functions that need them.
"""
