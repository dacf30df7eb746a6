from convert.cli import main

raise SystemExit(main())
