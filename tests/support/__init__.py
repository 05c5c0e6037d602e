"""What the tests share, written once, so that no test module imports another (tests/project/test_style.py
checks it) and a wait, a launch or a log check means the same in every test.

* :mod:`support.waiting`: ``wait_until``, the one polling loop with a deadline (fails naming what it waited
  for, with the log that explains why);
* :mod:`support.logs`: the roles' JSON log lines read back (``log_lines``, ``events``, ``wait_event``);
* :mod:`support.procs`: the roles as real processes: ``ZCLAW``, ``FAST``, ``free_port``, ``spawn``,
  ``Roles``, ``BrokerProc``, ``WorkerProcess``, ``Train``, and process inspection (``children``,
  ``rss_mib``, ``sigterm``);
* :mod:`support.peers`: peers the test plays with real sockets (a worker's PUSH, a learner's PUB +
  ROUTER) and the env spec and segments they send;
* :mod:`support.batches`: the learner's synthetic ``batch`` messages;
* :mod:`support.synthetic`: random segments in the wire layout, used by the wire, store and broker
  tests and by :mod:`support.peers`;
* :mod:`support.shell`: the shell scripts the project ships, parsed by bash and linted by shellcheck.

Fixtures over these (``roles``, ``start_broker``) are in tests/conftest.py.
"""
