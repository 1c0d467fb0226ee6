# Entry points. `make serve` and `make test` are the README's two commands.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: setup build test serve clean
setup:
	@scripts/setup.sh
$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release
build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900
serve: build
	scripts/serve.sh
clean:
	rm -rf $(BUILD)
