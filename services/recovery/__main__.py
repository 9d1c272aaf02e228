from services.recovery.main import main
from shared import service

service.run("recovery", main)
