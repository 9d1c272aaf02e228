from services.instance_manager.main import main
from shared import service

service.run("instance-manager", main)
