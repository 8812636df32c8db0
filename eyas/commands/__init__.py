"""eyas.commands"""
