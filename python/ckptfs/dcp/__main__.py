"""python -m ckptfs.dcp: the ckptfs-dcp command (ckptfs.dcp.stock.main),
as ckptctl import-dcp / export-dcp run it."""

import sys

from .stock import main

sys.exit(main())
