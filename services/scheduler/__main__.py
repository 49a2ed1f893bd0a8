from steploop.scheduler.server import main

main()
