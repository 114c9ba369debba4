import sys

from workloads.embed.pipeline import main

sys.exit(main())
