"""Loading a class named on the command line: a registry name, or `package.module:Name` from anywhere on
sys.path (a user's own file), checked against its protocol (schedules/protocol.py) before anything runs. Its own
module, outside schedules/, so that schedules, TP contractions, context strategies and the pure-Python pipeline
tables (pipeline_tables.py) can all use it without importing an executor.

User code runs before the step (a constructor, a pipeline table's `orders`): `call_user` and `user_code` turn what
it raises into one ConfigError line naming the setting and the user's file and line, so a bug in a user's file
reads like a bad setting (exit 2, nothing written), not like a crash of shardlab."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import sysconfig
from pathlib import Path

from shardlab.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent   # shardlab/: frames here are not the user's
LIBRARIES = tuple({str(Path(p).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")
                   if (p := sysconfig.get_paths().get(k))})


def protocol_members(proto) -> list[str]:
  """The methods and attributes a typing Protocol asks for (its own and its bases', public names)."""
  names: dict[str, None] = {}
  for base in reversed(proto.__mro__):
    if base in (object, proto.__mro__[-1]) or base.__name__ in ("Protocol", "Generic"):
      continue
    for n in (*getattr(base, "__annotations__", {}), *vars(base)):
      if not n.startswith("_"):
        names[n] = None
  return list(names)


def check_class(obj, spec: str, what: str, proto, methods_only: bool = False) -> None:
  """`obj` (what `spec` names) is a class with every method of `proto` (schedules/protocol.py), checked before
  anything runs; else a one-line ConfigError saying what is missing (a traced step would fail deep inside)."""
  where = f"shardlab/schedules/protocol.py: {proto.__name__}"
  if not inspect.isclass(obj):
    raise ConfigError(f"{what}={spec}: is {kind_of(obj)}, not a class; name a class with the {proto.__name__} "
                      f"methods ({where})")
  members = [n for n in protocol_members(proto) if not methods_only or callable(getattr(proto, n, None))]
  missing = [n for n in members if callable(getattr(proto, n, None)) and not callable(getattr(obj, n, None))]
  if missing:
    raise ConfigError(f"{what}={spec}: {obj.__name__} is not a {proto.__name__}: it has no {', '.join(missing)} "
                      f"({where}); subclass one of shardlab's or add them")


def kind_of(obj) -> str:
  """'a module', 'a function', 'an int', ...: what a loaded object is, for a message."""
  name = "module" if inspect.ismodule(obj) else type(obj).__name__
  return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def check_instance(obj, spec: str, what: str, proto) -> None:
  """An instance of a loaded class against `proto`, attributes included (set in __init__, e.g. seq_sharded)."""
  missing = [n for n in protocol_members(proto) if not hasattr(obj, n)]
  if missing:
    raise ConfigError(f"{what}={spec}: an instance of {type(obj).__name__} has no {', '.join(missing)} "
                      f"(shardlab/schedules/protocol.py: {proto.__name__}); subclass one of shardlab's or add them")


def _import(module: str, spec: str, what: str):
  """`module`, imported; what its import raises is one line: not found (with the hint about sys.path), or the
  user's file's own error (a syntax error, an exception at import, an import inside it that fails) at its line."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    ours = e.name is not None and (module == e.name or module.startswith(e.name + "."))
    if not ours:                # an import inside the user's module failed: its line
      raise ConfigError(_raised(e, spec, what, f"import {module}")) from e
    raise ConfigError(f"{what}={spec}: cannot import {module} ({e}); is its directory on sys.path "
                      f"(PYTHONPATH, or the current directory)?") from None
  except Exception as e:        # SyntaxError, or whatever the module raises as it runs
    raise ConfigError(_raised(e, spec, what, f"import {module}")) from e


def load_object(spec: str, what: str, registry: dict, proto=None):
  """A registry name, or `package.module:Name` imported from anywhere on sys.path; else one-line ConfigError.
  `proto`: a loaded `module:Name` must be a class with that protocol's methods (check_class)."""
  if spec in registry:
    return registry[spec]
  if ":" not in spec:
    raise ConfigError(f"{what}={spec}: unknown; known: {', '.join(registry)}, or package.module:Class")
  module, _, name = spec.partition(":")
  obj = _import(module, spec, what)
  for part in name.split("."):
    if not hasattr(obj, part):
      raise ConfigError(f"{what}={spec}: {module} has no {name}")
    obj = getattr(obj, part)
  if proto is not None:
    check_class(obj, spec, what, proto)
  return obj


# ------------------------------------------------------------------------------------------------ user code


def _mine(filename: str) -> bool:
  """A frame of shardlab's own code, of Python's or of an installed library: not where a user's bug is."""
  if filename.startswith("<"):                      # <frozen importlib._bootstrap>, <string>
    return True
  path = str(Path(filename).resolve())
  return path.startswith(str(PACKAGE) + "/") or path.startswith(LIBRARIES)


def _user_frame(e: BaseException, spec: str) -> tuple[str, int, str] | None:
  """(file, line, function) of the innermost frame of `e`'s traceback in the user's code: outside shardlab and
  outside the libraries. Where there is none and `spec` names a loaded object (`module:Name`: the user's setting
  made the call, e.g. with the wrong arguments), the innermost frame outside shardlab, else the innermost. A
  SyntaxError is where the parser says. None: no user code was involved (a bug of shardlab's)."""
  if isinstance(e, SyntaxError) and e.filename:
    return e.filename, e.lineno or 0, "<module>"
  frames, tb = [], e.__traceback__
  while tb is not None:
    code = tb.tb_frame.f_code
    frames.append((code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)))
    tb = tb.tb_next
  user = [f for f in frames if not _mine(f[0])]
  if not user and ":" in spec:
    user = [f for f in frames if not _same(f[0]).startswith(str(PACKAGE) + "/")] or frames
  return user[-1] if user else None


def _raised(e: BaseException, spec: str, what: str, call: str) -> str:
  """The one line for `e`, raised by user code while shardlab ran `call` for `what=spec`."""
  msg = " ".join(str(e.msg if isinstance(e, SyntaxError) else e).split()) or "(no message)"
  where = _user_frame(e, spec)
  at = f" (at {where[0]}:{where[1]})" if where else ""
  return f"{what}={spec}: {call} raised {type(e).__name__}: {msg}{at}; fix it there"


def _show(args: tuple, kwargs: dict) -> str:
  """A call's arguments for a message: numbers and strings as written, anything else as `...`."""
  plain = lambda a: isinstance(a, (bool, int, float, str)) or a is None
  if not all(map(plain, (*args, *kwargs.values()))):
    return "..."
  return ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])


@contextlib.contextmanager
def user_code(spec: str, what: str, call: str, others: dict[str, str] | None = None):
  """Run the block as a call of user code: an exception other than ConfigError, raised where a user's file is on
  the stack, becomes one line naming `what=spec`, `call` and the user's file and line. `others` ({setting: spec}):
  loaded objects the block may run too (a schedule builds its TP contraction and context strategy); the one whose
  module holds the raising frame is named instead. Raised where no user code is, it stays as it is: a bug of
  shardlab's, with its traceback."""
  try:
    yield
  except ConfigError:
    raise
  except Exception as e:        # noqa: BLE001  (whatever the user's code raises)
    where = _user_frame(e, spec)
    if where is None:
      raise
    for setting, other in (others or {}).items():
      if other != spec and _same(where[0]) == _file(other):
        raise ConfigError(_raised(e, other, setting, where[2])) from e
    raise ConfigError(_raised(e, spec, what, call)) from e


def _file(spec: str) -> str | None:
  """The source file of the module `spec` (`package.module:Name`) was loaded from, once it is loaded."""
  mod = sys.modules.get(spec.partition(":")[0]) if ":" in spec else None
  return _same(mod.__file__) if getattr(mod, "__file__", None) else None


def _same(path: str) -> str:
  """A path as one file is always written (absolute, links resolved): a frame's file and a module's compare."""
  return str(Path(path).resolve())


def call_user(fn, spec: str, what: str, *args, **kwargs):
  """fn(*args, **kwargs), where `fn` is user code `what=spec` loaded (a class to build, a table's `orders`): what it
  raises is one ConfigError line naming the setting, the call and the user's file and line (user_code)."""
  name = getattr(fn, "__name__", type(fn).__name__)
  with user_code(spec, what, f"{name}({_show(args, kwargs)})"):
    return fn(*args, **kwargs)


def accepts(fn, name: str) -> bool:
  """Whether `fn` (a class: its constructor) takes an argument called `name` (or any keyword: **kwargs)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):               # no signature to read (a builtin): pass it nothing extra
    return False
  return any(p.name == name and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD for p in params)
