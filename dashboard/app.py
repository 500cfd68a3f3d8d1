"""SpecPilot dashboard: the entry file (``streamlit run dashboard/app.py``, or
``python -m dashboard``).

A router: the login page until someone logs in, then the pages (one file each in
``pages/``) with the signed-in user and a log-out button in the sidebar. Viewers see
every page read-only; operators may also apply and roll back.
"""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="SpecPilot", page_icon=":material/speed:", layout="wide",
                   initial_sidebar_state="expanded")

from control import auth  # noqa: E402
from dashboard import ui  # noqa: E402


def login_page() -> None:
    """User name and password; on success the pages appear."""
    st.title("SpecPilot")
    st.caption("Operations dashboard for vLLM serving with adaptive speculative decoding")
    try:
        users = auth.load_users()
    except auth.AuthError as exc:
        st.error(f"The users file cannot be read: {exc}")
        st.stop()
    if not users:
        st.warning("No dashboard user is configured. Add one on the server with "
                   "`python -m dashboard users add NAME --role operator`.")
        st.stop()
    with st.form("login", clear_on_submit=False, width=420):
        name = st.text_input("User name", key="login_name", autocomplete="username")
        password = st.text_input("Password", type="password", key="login_password",
                                 autocomplete="current-password")
        submitted = st.form_submit_button("Log in", type="primary")
    if submitted:
        try:
            user = auth.authenticate(name, password, users)
        except auth.AuthError as exc:
            st.error(str(exc))
        else:
            st.session_state["user"] = user
            st.session_state.pop("login_password", None)
            st.rerun()


def _logout() -> None:
    for key in list(st.session_state.keys()):
        del st.session_state[key]


user = ui.current_user()
if user is None:
    page = st.navigation([st.Page(login_page, title="Log in", icon=":material/login:")], position="hidden")
else:
    pages = [
        st.Page("pages/live.py", title="Live", icon=":material/monitoring:", default=True),
        st.Page("pages/control.py", title="Control", icon=":material/tune:"),
        st.Page("pages/history.py", title="History", icon=":material/history:"),
        st.Page("pages/fleet.py", title="Fleet", icon=":material/dns:"),
        st.Page("pages/alerts.py", title="Alerts", icon=":material/notifications:"),
        st.Page("pages/cost.py", title="Cost review", icon=":material/payments:"),
        st.Page("pages/planner.py", title="Planner", icon=":material/query_stats:"),
    ]
    page = st.navigation(pages, position="sidebar", expanded=True)
    with st.sidebar:
        st.markdown(f"Signed in as **{user.name}** · {user.role}")
        if user.role == "viewer":
            st.caption("Read only: viewers cannot change configs.")
        st.button("Log out", on_click=_logout, icon=":material/logout:")
page.run()
