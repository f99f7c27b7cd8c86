"""Sphinx configuration for the jmp_lite documentation.

Build (warnings are errors): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))
# The docs import jmp_lite (API reference, formats table): never grab an accelerator for that.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jmp_lite

project = "jmp_lite"
author = "The jmp_lite authors"
copyright = "The jmp_lite authors"
version = release = jmp_lite.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
  "jmp_lite_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "README.md"]

# MyST: the pages are GitHub-flavoured Markdown that also reads well on GitHub.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 4  # GitHub-style anchors, e.g. (#1-audit-the-program-before-you-train)

# autodoc + napoleon: the docstrings are Google style with reStructuredText markup.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
add_module_names = False
python_use_unqualified_type_names = True

html_theme = "sphinx_book_theme"
html_title = f"jmp_lite {release}"
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
  "use_download_button": False,
}
html_static_path: list[str] = []
html_last_updated_fmt = None
