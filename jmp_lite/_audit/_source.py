"""Where an equation comes from: the user's source line, its scope, and whether autodiff made it.

JAX records a traceback and a name stack on every equation. :class:`FrameFilter`
sorts a traceback's files into JAX internals, other libraries and the user's
code (:mod:`jmp_lite._frames`, which jmp_lite's warnings use too), to name the
user's line; it also reads, from the same frames, whether a derivative rule
created the operation. :class:`Origin` is what the walk carries
down into nested jaxprs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from jmp_lite import _compat, _frames, _jaxpr
from jmp_lite._audit._report import SourceLocation
from jmp_lite._policy import Policy
from jmp_lite._policy_scope import innermost_policy, without_marks


def _bare_name(function_name: str) -> str | None:
  """``"rsqrt"`` for ``"_rsqrt"``; None for ``"f.<locals>.g"``, ``"<lambda>"``, methods."""
  name = function_name.lstrip("_")
  return name if name.isidentifier() else None


def _binds(function_name: str, primitive: str) -> bool:
  """Whether a JAX function of that name binds that primitive (``lax.select`` binds
  ``select_n``; ``_convert_element_type_bind_with_trace``, ``convert_element_type``)."""
  name = function_name.lstrip("_")
  return bool(name) and (name.startswith(primitive) or primitive.startswith(name))


class FrameFilter(_frames.SourceFiles):
  """Classifies source files (:class:`jmp_lite._frames.SourceFiles`) and reads tracebacks.

  Args:
    library_paths: extra directories whose files count as library code.
  """

  def __init__(self, library_paths: Collection[str]):
    super().__init__(library_paths)
    self._jax_files: dict[str, str | None] = {}

  def locate(self, traceback: Any) -> tuple[SourceLocation | None, SourceLocation | None]:
    """Finds the user's line and the library's line in a JAX traceback.

    Args:
      traceback: an equation's ``source_info.traceback`` (innermost frame
        first), or None.

    Returns:
      ``(user location, library location)``; the library location is None
      when it is the user's.
    """
    if traceback is None:
      return None, None
    user = library = None
    for frame in traceback.frames:
      kind = self.kind(frame.file_name)
      if kind == "internal":
        continue
      loc = SourceLocation(frame.file_name, frame.line_num, frame.function_name)
      if library is None:
        library = loc
      if kind == "user":
        user = loc
        break
    return user, (library if library != user else None)

  def _jax_file(self, filename: str) -> str | None:
    """:func:`jmp_lite._compat.jax_file`, once per file name."""
    if filename not in self._jax_files:
      self._jax_files[filename] = _compat.jax_file(filename)
    return self._jax_files[filename]

  def derivative_of(self, traceback: Any, primitive: str, differentiated: bool) -> tuple[bool, str]:
    """Whether a derivative rule created an operation, and which operation it differentiates.

    Two traceback shapes, innermost frame first:

    * Traced by the JVP/linearize trace (``jax.grad`` of code outside ``jit``):
      ``bind <- [lax wrapper <- derivative rule] <- ad.py <- bind <- lax.rsqrt
      <- user``. A JAX frame between the operation and ``ad.py`` that is not
      plumbing (nor the primitive's own ``bind`` wrapper) is the rule; the
      primal itself is bound by ``ad.py`` (or ``pjit``'s rule) directly. A frame
      of user code or of a ``custom_jvp`` rule there means the user wrote it.
    * Inside a differentiated ``jit``/``scan``/``checkpoint``, JAX gives a
      rule's operations the traceback of the operation they differentiate:
      the innermost ``jax/_src/lax`` function names another primitive
      (``div`` under ``lax.rsqrt``).

    Args:
      traceback: the operation's traceback, or None.
      primitive: the operation's primitive name.
      differentiated: whether the operation sits in a call (``jit``,
        ``scan``...) that is itself differentiated.

    Returns:
      ``(created_by_a_rule, name)``: ``name`` is the differentiated operation
      (``"rsqrt"``, ``"mean"``) or ``""`` when no frame names it.
    """
    if traceback is None:
      return False, ""
    frames = [(self._jax_file(f.file_name), f.function_name) for f in traceback.frames]
    ad = next((i for i, (rel, _) in enumerate(frames) if rel == _compat.JAX_AD), None)
    if ad is None:
      return self._rule_inside_call(frames, primitive) if differentiated else (False, "")
    rule = []
    for rel, function in frames[:ad]:
      if rel is None or rel == _compat.JAX_CUSTOM_RULES:
        return False, ""  # the user's code (or a custom_jvp rule) bound it
      if not _compat.is_jax_plumbing(rel):
        rule.append(function)
    # The primitive's own binding wrappers (_convert_element_type_bind_with_trace).
    while rule and _binds(rule[0], primitive) and "jvp" not in rule[0]:
      rule.pop(0)
    name = ""
    for rel, function in frames[ad:]:
      if rel is None:
        break
      if rel == _compat.JAX_AD or _compat.is_jax_plumbing(rel):
        continue
      bare = _bare_name(function)
      if bare and (_compat.is_jax_lax(rel) or not function.startswith("_")):
        name = bare
        break
    return bool(rule), name

  def _rule_inside_call(self, frames: list[tuple[str | None, str]], primitive: str):
    """The second traceback shape of :meth:`derivative_of`: the innermost frame
    that is not plumbing names the operation; a ``lax`` function that does not
    bind ``primitive`` is the operation differentiated."""
    for rel, function in frames:
      if rel is None or not _compat.is_jax_plumbing(rel):
        name = _bare_name(function) if rel is not None and _compat.is_jax_lax(rel) else None
        return bool(name and not _binds(name, primitive)), name or ""
    return False, ""


class Origin(NamedTuple):
  """Where an equation comes from, as the walk carries it into nested jaxprs."""

  scope: str  # the name stack, with those of the enclosing calls
  backward: bool  # part of the backward pass ("transpose(" in the name stack)
  location: SourceLocation | None
  library_location: SourceLocation | None
  # Inside jax.grad/jvp (a "jvp(" or "transpose(" name stack here or above).
  differentiated: bool = False
  # Inside a call (jit, scan...) that is itself differentiated.
  in_differentiated_call: bool = False
  traceback: Any = None
  # The policy of the innermost policy scope around it (jmp_lite.flax.policy_apply's), or None.
  policy: Policy | None = None


TOP = Origin("", False, None, None)
"""The origin of the audited jaxpr's own equations."""


def origin_of(parent: Origin, eqn: Any, frames: FrameFilter) -> Origin:
  """The origin of an equation of a jaxpr whose own origin is ``parent``.

  Args:
    parent: the origin of the equation that holds the jaxpr (:data:`TOP` at the top).
    eqn: the equation.
    frames: classifies the traceback's files.

  Returns:
    The equation's :class:`Origin`; equations JAX traced on behalf of the
    user (inside ``jnp.var``) keep the caller's line. Its scope leaves out
    the marks of policy scopes, whose policy it carries instead.
  """
  info = eqn.source_info
  name = str(info.name_stack) if info is not None else ""
  policy = innermost_policy(name) or parent.policy
  scope = "/".join(s for s in (parent.scope, without_marks(name)) if s)
  traceback = getattr(info, "traceback", None)
  user, library = frames.locate(traceback)
  if user is None:  # e.g. equations JAX traced inside jnp.var: keep the caller's line
    user, library = parent.location, library or parent.library_location
  # JAX renders the backward pass as "transpose(jvp(...))" in name stacks.
  backward = parent.backward or "transpose(" in name
  differentiated = parent.differentiated or backward or "jvp(" in name
  return Origin(
    scope, backward, user, library, differentiated, parent.differentiated, traceback, policy
  )


def derivative_of(eqn: Any, origin: Origin, frames: FrameFilter) -> str | None:
  """Whether autodiff created an equation, and for which operation.

  Args:
    eqn: the equation.
    origin: its origin.
    frames: classifies the traceback's files.

  Returns:
    None when the user's code wrote ``eqn``; when autodiff created it, the
    operation it differentiates (``""`` when unknown).
  """
  if not origin.differentiated:
    return None
  created, name = False, ""
  # A call or loop (jit, scan) holds both a primal and its derivative: its
  # equations are judged one by one.
  if not _jaxpr.sub_jaxprs(eqn):
    created, name = frames.derivative_of(
      origin.traceback, eqn.primitive.name, origin.in_differentiated_call
    )
  return name if created or origin.backward else None
