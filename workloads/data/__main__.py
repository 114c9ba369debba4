import sys

from workloads.data.pipeline import main

sys.exit(main())
