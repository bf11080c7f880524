// Command fakeplugin stands in for mountplan-plugin in the harness's own
// tests: it takes the same basic flags, listens on the unix socket, and
// exits 0 on SIGTERM after removing the socket.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
)

func main() {
	endpoint := flag.String("endpoint", "", "unix:///path.sock")
	stateDir := flag.String("state-dir", "", "state directory")
	nodeID := flag.String("node-id", "", "node name")
	_ = flag.String("kubelet-dir", "", "kubelet directory (taken like the real plugin's, unused)")
	flag.Parse()

	sock := strings.TrimPrefix(*endpoint, "unix://")
	if sock == *endpoint || sock == "" {
		fmt.Fprintln(os.Stderr, "fakeplugin: --endpoint must be unix:///path")
		os.Exit(2)
	}
	if err := os.MkdirAll(*stateDir, 0o700); err != nil {
		fmt.Fprintln(os.Stderr, "fakeplugin:", err)
		os.Exit(1)
	}
	if err := os.WriteFile(filepath.Join(*stateDir, "node-id"), []byte(*nodeID), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, "fakeplugin:", err)
		os.Exit(1)
	}
	_ = os.Remove(sock) // stale socket of a crashed predecessor
	l, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakeplugin:", err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "fakeplugin: listening on %s as %s\n", sock, *nodeID)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	<-sigs
	l.Close() // removes the socket file
	fmt.Fprintln(os.Stderr, "fakeplugin: stopped")
}
