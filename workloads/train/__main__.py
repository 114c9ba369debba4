import sys

from workloads.train.driver import main

sys.exit(main())
