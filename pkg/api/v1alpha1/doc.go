// Package v1alpha1 is mountplan's own gRPC API beside the CSI services: the
// NodePrepare service the plugin serves on its CSI socket (answer a mount
// plan instead of mounting) and the Mounter service the sidecar serves
// (perform plans, start FUSE daemons). The .pb.go files are generated from
// mountplan.proto by hack/update-codegen.sh; edit the proto, not them.
package v1alpha1
