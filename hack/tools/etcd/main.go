// Command etcd is etcd's server, built from the module proxy: etcd's own
// main package lives in a module whose go.mod has replace directives, so
// `go install` refuses it, while etcdmain (the whole server behind that
// main) is a plain library. hack/tools/build.sh builds this module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
