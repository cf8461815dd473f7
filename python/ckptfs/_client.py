"""ckptfs._client - the old name of ckptfs.client, kept for code written
against it (ckptfs._client.mount_world, docs/mounting.md): importing it
gives the ckptfs.client module itself, so that what is set on one is set
on the other."""

import sys

from . import client

sys.modules[__name__] = client
