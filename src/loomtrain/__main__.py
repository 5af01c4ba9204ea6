"""`python -m loomtrain ...` (what torchrun runs on every node) is the `loom` command."""

import sys

from loomtrain.cli import main

sys.exit(main())
