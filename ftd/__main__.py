from ftd.cli.main import main

raise SystemExit(main())
