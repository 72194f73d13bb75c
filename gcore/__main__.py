import os
import sys

# ``python -m gcore`` puts the working directory first on the path: where it holds a ``gcore`` folder (runs written
# with ``--trainer.default_root_dir .``) and gcore is installed editable (an import hook, not a path folder), Python
# took that folder for a namespace package ``gcore``; the folder holding this file's package goes first instead
if getattr(sys.modules.get("gcore"), "__file__", None) is None:
    sys.modules.pop("gcore", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from gcore.cli import entry

sys.exit(entry())
