import sys

from services.gpu_worker.server import main

sys.exit(main())
