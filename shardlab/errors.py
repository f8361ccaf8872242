"""The two errors shardlab reports in one line (a leaf module: raising one imports nothing else, not the mesh).

  ConfigError  a setting, or user code named by one, that cannot work: one line naming the setting and the fix,
               exit 2, before anything compiles or is written (run.py turns it into that line)
  RunError     a fault seen only at run time (a lost peer, a failed save, a directory that is not shared): one
               line, exit 1
"""


class ConfigError(ValueError):
  """A setting that cannot work; its message is one line naming the setting and the fix."""


class RunError(RuntimeError):
  """A fault seen only at run time (a lost peer, a failed save, a directory that is not shared): one line, exit 1."""
