import sys

from attnserve.bench.run import main

sys.exit(main())
