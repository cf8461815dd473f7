"""The helpers of the ckptfs tests (tests/integration/, python/tests/), one
package, Python standard library only:

    util       one-rank mounts (Mount, CkptfsTestCase and its world
               fixture), the trainer's file calls, tensor bytes, main()
    world      a world of N rank mounts under mpirun (World), the
               trainers' side of a world (Tensor, Blob, commit_all)
    sanenv     the one builder of the sanitizers' environment, for every
               daemon, mpirun world and mount script a test starts
    netns      simulated nodes: network and mount namespaces on a bridge
    networld   worlds started by ckpt-mount --hostfile across those
               nodes, and their test case (NetnsCase)
    pyenv      the interpreter with torch, and how code runs in it
    slowstore  a slow shared store (a throttled loop device)

with their data files: netns-agent (Open MPI's "ssh" into a node),
lsan-openmpi.supp and tsan.supp (the sanitizers' suppressions).

A test imports them as a package: `from ckpttest import util`,
`from ckpttest.world import World`. tests/integration/test_x.py needs
nothing more (a script's own directory is on sys.path):

    python3 tests/integration/test_x.py --bin build/bin/ckptfs [Class ...]

python/tests/test_x.py finds this package and the client under test
(python/) through PYTHONPATH, which ctest sets:

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_x.py --bin build/bin/ckptfs [Class ...]
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout: tests/integration/ckpttest -> the top
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
