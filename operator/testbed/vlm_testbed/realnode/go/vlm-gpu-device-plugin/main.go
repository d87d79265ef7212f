// Command vlm-gpu-device-plugin advertises N stand-in GPUs to one kubelet through the
// device-plugin API v1beta1: it serves ListAndWatch/Allocate on a socket in the kubelet's
// device-plugins directory and registers there. Allocate puts the chosen device ids into the
// container's environment as NVIDIA_VISIBLE_DEVICES, as NVIDIA's plugin does.
// Built inside the Kubernetes source tree, against its vendored API and grpc.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	devs []*pluginapi.Device
	ids  map[string]bool
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devs}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, cr := range r.ContainerRequests {
		for _, id := range cr.DevicesIDs {
			if !p.ids[id] {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		fmt.Printf("allocate %s\n", strings.Join(cr.DevicesIDs, ","))
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(cr.DevicesIDs, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func dialUnix(ctx context.Context, path string) (*grpc.ClientConn, error) {
	return grpc.DialContext(ctx, path, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
}

// serveOnce serves and registers, then returns when the socket vanishes (the kubelet
// restarted and cleared its directory) or a signal arrives (then it returns false).
func serveOnce(p *plugin, dir, resource, sock string, stop chan os.Signal) bool {
	os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintf(os.Stderr, "listen %s: %v\n", sock, err)
		time.Sleep(time.Second)
		return true
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go srv.Serve(lis)
	defer srv.Stop()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	conn, err := dialUnix(ctx, filepath.Join(dir, "kubelet.sock"))
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet socket not answering: %v\n", err)
		time.Sleep(time.Second)
		return true
	}
	_, err = pluginapi.NewRegistrationClient(conn).Register(context.Background(), &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: filepath.Base(sock), ResourceName: resource,
	})
	conn.Close()
	if err != nil {
		fmt.Fprintf(os.Stderr, "register: %v\n", err)
		time.Sleep(time.Second)
		return true
	}
	fmt.Printf("registered %s with %d devices at %s\n", resource, len(p.devs), sock)
	for {
		select {
		case <-stop:
			return false
		case <-time.After(500 * time.Millisecond):
		}
		if _, err := os.Stat(sock); err != nil {
			fmt.Println("socket removed (kubelet restarted?): registering again")
			return true
		}
	}
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugins directory")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	count := flag.Int("count", 1, "number of devices")
	prefix := flag.String("id-prefix", "GPU-", "device id prefix (ids are prefix + index)")
	flag.Parse()

	p := &plugin{ids: map[string]bool{}}
	for i := 0; i < *count; i++ {
		id := fmt.Sprintf("%s%d", *prefix, i)
		p.devs = append(p.devs, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
		p.ids[id] = true
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	sock := filepath.Join(*dir, "vlm-gpu.sock")
	for serveOnce(p, *dir, *resource, sock, stop) {
	}
	os.Remove(sock)
}
