import sys

from moeswap.cli import main

sys.exit(main())
