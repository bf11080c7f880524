package volview

import (
	"context"
	"net/http"
)

// Handler serves the report list makes, checked against the kernel
// through proc, as JSON (GET only).
func Handler(list func(context.Context) *Report, proc Proc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodGet && req.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "only GET", http.StatusMethodNotAllowed)
			return
		}
		r := list(req.Context())
		proc.Check(r)
		w.Header().Set("Content-Type", "application/json")
		_ = WriteJSON(w, r)
	})
}
