from ftd.cli import main

raise SystemExit(main())
