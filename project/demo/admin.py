from django.contrib import admin

from .models import Account


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "owner", "balance", "fence", "fence_step"]
    readonly_fields = ["fence", "fence_step"]
