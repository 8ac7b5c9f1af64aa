"""Worker-side code for the tests: the functions the tests run inside workers.

Data flow: a test names a function here either as a target string (``"tasks.remote:add"``)
or as the function itself (``remote_tasks.add``, sent by reference as ``tasks.remote:add``).
Both sides import it by that dotted name from one root, ``tests/``:

- the pytest process has ``tests/`` on ``sys.path`` (pytest puts the conftest's directory
  there, ``tests/`` having no ``__init__.py``);
- workers get it from the host, and only from it: ``PoolConfig.sys_path=(TESTS_DIR,)`` (the
  ``config``/``apool`` fixtures in ``tests/conftest.py``), or ``COMFY_ENV_SYS_PATH``; a
  worker's environment never inherits the host's ``PYTHONPATH``;
- host scripts that the tests start (``conftest.run_host``) get ``PYTHONPATH=tests/``.

The modules are grouped by the tests they serve (``remote`` is the general one). They must
import on any Python an env may have (3.8 and newer), and at module level import only the
standard library (``numpy_skew`` needs numpy): a worker of a bare env imports them too.
"""
