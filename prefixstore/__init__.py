"""prefixstore: the distributed external prefix store for LLM serving engines."""

import os as _os

__version__ = "0.1.0"

# In a checkout the parts live beside this directory (protocol/, store/, client/, ...; pyproject.toml
# maps them under this package when it installs them). Run from the checkout's root
# (`python -m prefixstore`, a REPL importing prefixstore.client), the current directory comes first
# on sys.path, so this source directory is found before any installed copy, and without the line
# below its submodules would be looked for inside it alone: "No module named
# 'prefixstore.admission'". The checkout's root joins the package's search path only when this file
# sits in a checkout (its pyproject.toml beside it, the parts not inside it), never in an
# installed copy. Rejected: a src/ layout (the design card fixes one directory per part at the top).
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if (_os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_root, "store", "__init__.py"))
        and not _os.path.isdir(_os.path.join(_here, "store"))
        and _root not in __path__):
    __path__.append(_root)
