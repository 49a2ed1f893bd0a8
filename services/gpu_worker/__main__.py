import sys

from steploop.gpu_worker.server import main

sys.exit(main())
