// Package v1alpha1 is mountplan's own gRPC API beside the CSI services: the
// NodePrepare service the plugin serves on its CSI socket (answer a mount
// plan instead of mounting), for container runtimes and the sidecar. The
// .pb.go files are generated from mountplan.proto by hack/update-codegen.sh;
// edit the proto, not them.
package v1alpha1
