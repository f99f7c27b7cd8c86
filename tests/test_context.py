import threading

from jmp_lite._context import Ambient


def test_scopes_nest_and_restore():
  ambient = Ambient[int]("test_scopes_nest")
  assert ambient.current() is None and ambient.all() == ()
  with ambient.scope(1):
    with ambient.scope(2) as value:
      assert value == 2 and ambient.current() == 2 and ambient.all() == (1, 2)
    assert ambient.current() == 1
  assert ambient.all() == ()


def test_scope_restored_after_an_exception():
  ambient = Ambient[str]("test_scope_exception")
  try:
    with ambient.scope("inner"):
      raise RuntimeError
  except RuntimeError:
    pass
  assert ambient.current() is None


def test_each_thread_sees_its_own_values():
  ambient = Ambient[str]("test_threads")
  seen = []
  with ambient.scope("main"):
    thread = threading.Thread(target=lambda: seen.append(ambient.current()))
    thread.start()
    thread.join()
    assert ambient.current() == "main"
  assert seen == [None]
